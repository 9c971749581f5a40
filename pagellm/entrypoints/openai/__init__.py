"""The OpenAI-compatible server (`pagellm serve`): FastAPI routes on one AsyncLLM."""
