"""specdec_kit.loadtest: the Locust load test (``locust -f loadtest/chat.py``), its metrics, report and sweep."""
