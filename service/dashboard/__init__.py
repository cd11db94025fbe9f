"""The web dashboard: static HTML, JS and CSS served by the API, talking to the public /v1 API."""
