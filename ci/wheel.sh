#!/usr/bin/env bash
# The wheel as a user gets it: build it (`python -m build --wheel`, the build backend pyproject.toml names, in an
# isolated environment), install it with --no-deps into a fresh virtual environment that sees this Python's
# packages (torch, transformers) but not the editable kvpass install.sh made, and run examples/quickstart.py from
# a temporary folder outside the repository. Fails when the wheel misses a module the quickstart imports, or when
# the kvpass that ran is not the wheel's. Run after install.sh (it installs build); takes well under a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Build from a clean copy of what the wheel is made of: an in-place build would reuse setuptools' build/ folder,
# where a module deleted since the last build still lies.
mkdir "$TMP/src"
cp -r pyproject.toml README.md kvpass "$TMP/src/"
find "$TMP/src" -name __pycache__ -prune -exec rm -rf {} +
python -m build --wheel --outdir "$TMP/dist" "$TMP/src" >"$TMP/build.log" 2>&1 \
    || { cat "$TMP/build.log"; echo "ci/wheel.sh: the wheel did not build"; exit 1; }
WHEEL=$(echo "$TMP"/dist/kvpass-*.whl)
echo "wheel: $(basename "$WHEEL")"

# This Python's site-packages folders go into the venv's as plain path lines: appended after the venv's own
# site-packages, and their .pth files are not run, so the editable install's import hook (a .pth file) never loads.
python -m venv --without-pip "$TMP/venv"
VPY="$TMP/venv/bin/python"
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
    >"$SITE/ci-parent-packages.pth"
# pip comes from this Python's packages; --ignore-installed: the editable kvpass it sees there is neither
# uninstalled nor taken as the wheel already installed
"$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-installed "$WHEEL" \
    >"$TMP/pip.log" 2>&1 || { cat "$TMP/pip.log"; echo "ci/wheel.sh: the wheel did not install"; exit 1; }

mkdir "$TMP/run"
cp examples/quickstart.py "$TMP/run/"
cd "$TMP/run"
"$VPY" - "$TMP/venv" <<'EOF'
import os, sys
import kvpass
venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(kvpass.__file__)
print("kvpass.__file__:", kvpass.__file__)
if not where.startswith(venv + os.sep):
    sys.exit(f"ci/wheel.sh: kvpass was imported from {where}, not from the wheel installed in {venv}")
EOF
"$VPY" quickstart.py >"$TMP/quickstart.log" 2>&1 || { cat "$TMP/quickstart.log"; echo "ci/wheel.sh: quickstart failed"; exit 1; }
echo "quickstart.py (last lines):"
tail -n 5 "$TMP/quickstart.log"
