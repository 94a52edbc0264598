"""Routing as a pipeline of plugins, in the shape of the Gateway API Inference Extension's
scheduler (the endpoint picker that llm-d runs): per request, a profile handler chooses a
scheduling profile; the profile's filters and ordered rules run in the order listed, then its
weighted scorers (each score in [0, 1]), then its picker. Plugins that keep state see each
placement before the request goes (pre-request) and each response after (post-response).

Sans-I/O: ``Pipeline.place`` takes the request's features and a snapshot of the fleet
(``Candidate``s) and returns where the request goes and why; nothing here awaits, and the relay
(``specgate serve``) and the endpoint picker (``specgate epp``) call one shared instance.

- ``framework``: the cycle, the plugin roles, a profile and the pipeline;
- ``plugins/``: one module per plugin type (``registry`` names them);
- ``config``: the ``routing:`` section (GIE's ``plugins`` and ``schedulingProfiles``), and the
  pipeline the old ``policy.route_*`` keys describe;
- ``store``: the live pipeline, reconfigured in place on a reload (plugins keep their state).

The policy's decision where the request lands is the placement's last stage,
``gateway/placement.py``, above the fleet it reads (docs/routing.md).
"""
