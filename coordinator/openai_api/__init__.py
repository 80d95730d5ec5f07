"""The OpenAI-compatible HTTP API of the coordinator: /v1/chat/completions, /v1/completions,
/v1/models and /health, served by the coordinator process on its own event loop (an ASGI app
under uvicorn) and answered by the same `CoordinatorServicer.generate` as gRPC — one
admission, one set of limits, one log and metrics path. gRPC stays the primary contract;
this is the API every OpenAI client, framework and load tool already speaks.

- schemas: the request bodies (pydantic), and their translation to a GenerateRequest;
- errors: OpenAI's error object and the HTTP status of every specdec failure;
- app: the routes, streaming as server-sent events;
- server: uvicorn embedded in the coordinator's loop, on a socket bound up front.
"""
