"""The OpenAI-compatible HTTP server: `build_app(engine)` (app.py) and `kdaserve serve`."""
