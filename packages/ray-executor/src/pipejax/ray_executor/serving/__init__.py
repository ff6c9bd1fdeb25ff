"""Online serving: DP engine cores over ZMQ, the DP coordinator, the OpenAI-compatible HTTP server, its benchmark.

Import the modules you need; this package imports nothing at import time (the CLI reads its flags cheaply).
"""
