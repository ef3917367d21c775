"""``a+b``: composition of policies.

Members contribute by role. At most one member may evict (decide what the cache keeps); the
others may change how attention reads what is kept (for example ART on top of an eviction
policy). A site is planned by merging the members' plans: it evicts if the evicting member says
so, and runs through a kvpass attention operator if any member asks for it. Parameters are routed
to every member that declares them.
"""

from __future__ import annotations

import dataclasses

from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan


class Composed(Policy):
    def __init__(self, members: list[Policy]) -> None:
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ConfigError(f"policy '{'+'.join(names)}' names a policy twice")
        evictors = [m for m in members if m.needs.evicts]
        if len(evictors) > 1:
            raise ConfigError(
                f"policy '{'+'.join(names)}': {evictors[0].name} and {evictors[1].name} both "
                "evict; compose at most one eviction policy with attention policies"
            )
        self.members = members
        self.evictor = evictors[0] if evictors else None

    @property
    def config(self) -> dict:  # type: ignore[override]
        return {f"{m.name}.{k}": v for m in self.members for k, v in m.config.items()}

    @property
    def needs(self) -> Needs:  # type: ignore[override]
        """The evicting member's needs (what the cache stores is its choice), with a SlotCache rule only when
        every member has one."""
        rules = [m.needs.slot_rule for m in self.members]
        base = self.evictor.needs if self.evictor else self.members[0].needs
        return dataclasses.replace(base, slot_rule=None if None in rules else base.slot_rule, plain_prefill=False)

    @property
    def slot_protect(self) -> int:
        return self.evictor.slot_protect if self.evictor else 0

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        return (
            self.evictor.slot_capacity(max_length, max_new_tokens, layer, layers, ranks) if self.evictor else max_length
        )

    @property
    def _stateful(self) -> Policy | None:
        """The member that keeps SlotCache layer state (quest's page bounds); two would each need their
        own state list and hooks, which the SlotCache does not compose: refused."""
        stateful = [m for m in self.members if m.slot_state(1, 1)]
        if len(stateful) > 1:
            raise ConfigError(
                f"policy '{self.name}': {stateful[0].name} and {stateful[1].name} both keep SlotCache "
                "state; compose at most one of them on a SlotCache"
            )
        return stateful[0] if stateful else None

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        return self._stateful.slot_state(capacity, head_dim, groups) if self._stateful else {}

    def slot_hooks(self, site):
        return self._stateful.slot_hooks(site) if self._stateful else None

    @property
    def name(self) -> str:  # type: ignore[override]
        return "+".join(m.name for m in self.members)

    def check_model(self, config) -> None:
        for m in self.members:
            m.check_model(config)

    def graph_refusal(self, sites) -> str | None:
        return next((why for m in self.members if (why := m.graph_refusal(sites))), None)

    def idle_reason(self, sites) -> str | None:
        return next((why for m in self.members if (why := m.idle_reason(sites))), None)

    def plan(self, site) -> SitePlan | Refusal:
        plans = []
        for m in self.members:
            p = m.plan(site)
            if isinstance(p, (Refusal, str)):  # a member's refusal (a bare string reads as one) is the site's
                return p if isinstance(p, Refusal) else Refusal(p)
            plans.append(p)
        reads = [p.read for p in plans if p.read is not None]
        if len(reads) > 1:
            return Refusal("two members both set how decode attention reads the cache")
        return SitePlan(
            attention=any(p.attention for p in plans),
            evict=any(p.evict for p in plans),
            read=reads[0] if reads else None,
            tokens=any(p.tokens for p in plans),
            pool=any(p.pool for p in plans),
            overwrite=any(p.overwrite for p in plans),
            votes=any(p.votes for p in plans),
            layer_votes=max(p.layer_votes for p in plans),
            lse=any(p.lse for p in plans),
            rope=any(p.rope for p in plans),
            out_proj=any(p.out_proj for p in plans),
        )

    def stored_length(self, site, total):
        return self.evictor.stored_length(site, total) if self.evictor else total

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, **extra):
        return self.evictor.select(site, q, k, v, kv_pos, q_pos, layer_state, **extra) if self.evictor else None

    def write(self, site, q, k_pool, v_pool, k_new, v_new, q_pos, layer_state):
        return self.evictor.write(site, q, k_pool, v_pool, k_new, v_new, q_pos, layer_state)

    def key(self) -> str:
        return "+".join(m.key() for m in self.members)

    def uuid(self) -> str:
        import hashlib

        return hashlib.sha256("".join(m.uuid() for m in self.members).encode()).hexdigest()

    def __repr__(self) -> str:
        return " + ".join(repr(m) for m in self.members)
