"""What a server says about itself: GET /status and /status.json, the history behind the
page's charts, and the Prometheus metrics of GET /metrics."""
