"""The compiler pass, in pipeline order: ``detect`` finds every attention site and cache update in a Dynamo graph
(``maskcheck`` proves a mask plainly causal; ``tp`` finds the tensor-parallel group of a split model's heads),
the policy plans each site (``kvpass.policies.contract``),
``rewrite`` replaces the sites with kvpass operators and fixes derived positions, ``gate`` splits a gated
prefill into segments, ``backend`` runs the whole pass as a ``torch.compile`` backend (``recording`` notes the
calls of the graphs it compiled) and ``explain`` reports it. The generation runtime that runs compiled models
(``kvpass.compile``'s ``generate``, the request queue) is ``kvpass.generate``."""
