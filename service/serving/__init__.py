"""Serving fine-tuned and base models over OpenAI's completions APIs (the API's side; no torch here).

The API validates and authorizes a request, then hands it to a serving
worker (worker/serving/) through a `Channel` (Redis lists, or a SQLite file
on the embedded default), routed by base model; the worker streams the reply
back on a list of the request's own.
"""
