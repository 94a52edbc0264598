"""What the operator wrote, read: config.yaml parsed once into frozen, validated sections
(config.py), the error every section raises (errors.py), the ``auth:`` section (auth.py), the
``SPECGATE_*`` environment overrides (env_overrides.py), the safe YAML loader (safe_yaml.py), and
the one watcher that reloads the file's live parts while the gateway runs (watcher.py)."""
