"""The HTTP adapter: the API's routes (api.py), their request/response models (schemas.py) and
input rules (input.py), authentication (auth.py), the API docs pages (api_docs.py), the metrics
middleware and the operators' dashboard (dashboard/). It calls the service; nothing below it
imports it."""
