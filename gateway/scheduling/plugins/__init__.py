"""The routing plugins, one type a module (``gateway.scheduling.registry`` names them)."""
