"""``lantern serve``: an HTTP server over a continuous-batching scheduler.

``scheduler`` (the engine side: jobs, tickets, batches), ``schema`` (the request and response
bodies), ``plan`` (a request checked against the model: jobs and resolved settings), ``metrics``
(counters and their Prometheus text), ``app`` (the FastAPI app) and ``static/`` (the web page).
Only ``app`` imports FastAPI (the ``serve`` extra); nothing here is imported by ``import lantern``.
"""
