"""The Tinker API (Thinking Machines' training SDK, `tinker`) as this service answers it: its wire codec (wire.py)
over the SDK's own protobuf schema (schema.py). The SDK and tinker-cookbook run against the service unmodified
with only their base URL changed (docs/TINKER.md).
"""
