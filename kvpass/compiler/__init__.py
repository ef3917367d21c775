"""The compiler pass, in pipeline order: ``detect`` finds every attention site and cache update in a Dynamo graph
(``maskcheck`` proves a mask plainly causal), the policy plans each site (``kvpass.policies.contract``),
``rewrite`` replaces the sites with kvpass operators and fixes derived positions, ``gate`` splits a gated
prefill into segments, ``backend`` runs the whole pass as a ``torch.compile`` backend, ``explain`` reports it."""
