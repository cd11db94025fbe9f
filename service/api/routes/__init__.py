"""One router per resource; each route calls a small service function and commits at its end."""
