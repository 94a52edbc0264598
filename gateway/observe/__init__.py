"""What the gateway reports about itself: the dashboard metrics (metrics.py), the operational
counters beside them (ops_metrics.py), and OpenTelemetry tracing (tracing.py)."""
