"""``make serve``: a trained run behind a local HTTP server (FastAPI + uvicorn): a page that translates and draws
the attention, and a JSON API whose concurrent requests share decoding calls.

    config.py  the serve.* settings          schema.py   request and response models
    engine.py  a run loaded, one batch call  batcher.py  concurrent requests gathered into batches
    app.py     the routes                    server.py   make serve: load, bind, run
    bench.py   requests/s and latency of concurrent clients (make bench ARGS="name=<run> bench.serve=true")
"""
