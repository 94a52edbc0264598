"""The endpoint picker behind Envoy: the ext_proc server (picker.py), one request's exchange with
Envoy (exchange.py), what a response teaches the picker (feedback.py), and the Envoy configs that
ask it or front the replicas (envoy_config.py, ``python -m gateway.epp.envoy_config``)."""
