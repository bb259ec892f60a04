"""`lmcli serve`: an OpenAI-compatible HTTP server over one continuous batch (lmcli.generation.continuous).

- requests.py: a request body -> rows (the field rules are jobs/openai_batch.py's), or an ApiError in OpenAI's shape;
- scheduler.py: the one thread that owns the model and the continuous run; rows in through a bounded
  queue, each row's tokens out to its request on the event loop;
- app.py: the ASGI app (starlette): routes, limits, API key, server-sent events, the request log;
- server.py: `lmcli serve` itself (load, bind, uvicorn, SIGTERM);
- client.py: `lmcli generate --server URL`, which imports neither torch nor this package's server side.

Only client.py is imported on the client's path; the rest imports starlette and uvicorn (the `serve` extra).
"""
