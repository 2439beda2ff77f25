"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), served by the gateway beside gRPC on the shared serving
state: completions, chat completions, models, tokenize / detokenize, health, metrics and version."""
