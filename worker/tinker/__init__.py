"""The Tinker API's worker side: the request rows the API writes, run on the engine (worker/engine/)."""
