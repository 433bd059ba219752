"""The live dashboard: a page, its live feed and Prometheus metrics, served by the coordinator
(and the job server) behind an access token (see server.py)."""
