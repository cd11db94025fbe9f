"""All SQL lives here. Functions take a Session and never commit: the request
or task boundary does. Every lookup is scoped to a project."""
