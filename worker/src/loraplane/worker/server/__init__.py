"""The worker HTTP server: FastAPI app, protocol models, metrics, fault injection."""
