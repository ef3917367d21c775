"""Layer-gated token propagation: deeper layers of a prefill compute only the selected tokens.

ASL, FastKV and GemFilter-style policies keep running the prompt through the first layers on every
token, pick the tokens that matter after some layer's attention (the *selection layer*), and let
the deeper layers compute only those. In a Dynamo graph that is a sequence-length change in the
middle of the graph: with static shapes the length is a literal in every ``view``/``reshape`` of
the deeper layers, with dynamic shapes it is the input's symbol, and for ASL the layer where it
happens is only known at run time.

How kvpass carries it (docs/ARCHITECTURE.md section 3, "Layer-gated propagation"): the rewritten
prefill graph is **split at the gates** (the residual add after each candidate layer's attention)
into segments, and the backend returns a small Python runner instead of one compiled graph. The
runner executes the segments in order; after a candidate layer it asks the policy whether this is
the selection layer; if so it gathers every value that crosses into the deeper segments along its
token dimensions (residual stream, RoPE cos/sin at dim -2, position ids, 4-D masks by rows and
columns), and runs the deeper segments in a *short version* built for ``n`` tokens:

* static graphs: a copy of the segment whose literal sequence lengths (``L`` in ``view``,
  ``reshape``, ``arange``, slices) are replaced by ``n``; kvpass refuses when ``L`` equals a model
  dimension (head count, head size, a weight dimension), where a literal would be ambiguous;
* dynamic graphs: the same segment, fed ``n`` for every symbolic integer equal to the sequence
  symbol (sizes computed inside the segment follow the gathered tensors by themselves).

Each segment version is compiled by the inner compiler (Inductor on GPU) on first use with the
real inputs and cached by input shapes, so the deeper layers really run at ``n`` tokens. Decode
graphs are not split. A graph the gate does not understand is left as an evicting graph without
gating and kvpass warns why; it is never silently pruned wrong.

Masks of the deeper layers are exact: the gathered tokens keep their order, so the model's causal
(and padding) mask restricted to their rows and columns is the mask of their true positions, and
``is_causal`` SDPA over them is the same thing. RoPE uses the gathered original positions. After
the prefill the runner records in the generation state the true positions of what every deeper
layer stored, so decode (``cache_update`` + ``attention_pos``) continues from the prompt length.

The package, by job: ``checks`` (can the gate be placed in this graph), ``partition`` (the score nodes and
the split into segments, and how each value that crosses a gate is carried), ``take`` (a value restricted
to the selected tokens, positions renumbered and recorded), ``runner`` (``GatedGraph``: the callable the
backend returns, which runs the segments, asks the policy at each candidate layer and records what the
deeper layers stored).
"""

from kvpass.compiler.gate.checks import check
from kvpass.compiler.gate.runner import GatedGraph, GateInfo, plan

__all__ = ["GateInfo", "GatedGraph", "check", "plan"]
