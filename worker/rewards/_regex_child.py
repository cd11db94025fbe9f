"""The matching child: runs one user pattern, or one JSON Schema, against a batch of texts, answering text by text.

Started by worker/rewards/regex.py as ``python -I -S -B -c <this source>``.
Standard library only, but for jsonschema, imported from the directories a
schema request names. A pattern or a schema is data, not code: it cannot open
files or sockets, so this child needs no sandbox, only to be killable (its
parent does that at a deadline) and bounded in memory (the rlimit below).

Protocol, JSON lines on stdin/stdout:

  parent: {"pattern": str, "full_match": bool, "texts": [str...]}      (the regex reward)
      or: {"schema": {...}, "sys_path": [str...], "texts": [str...]}   (json_schema: is each text conforming JSON?)
  child:  "+" once the request is read and its matcher built (the parent starts the first text's clock
          here, so interpreter start-up and imports never count against a sample), then one line per text,
          in order, flushed at once: "1" (matched) or "0", or "!" and what the text raised (that sample's error)
"""

import json
import re
import resource
import sys

MEMORY_BYTES = 1 << 30  # a backtracking stack or a huge repetition fails with MemoryError, not the host


def regex_matcher(request):
    pattern = re.compile(request["pattern"])  # validated by the API: a failure here is a crash, reported
    return pattern.fullmatch if request["full_match"] else pattern.search


def _not_json(name):
    raise ValueError(f"{name} is not JSON")


def schema_matcher(request):
    """True where the text is JSON that conforms to the schema; its `pattern`s run here, under the deadlines."""
    for path in request["sys_path"]:
        if path not in sys.path:
            sys.path.append(path)
    import jsonschema

    schema = request["schema"]
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)

    def conforms(text):
        try:
            value = json.loads(text, parse_constant=_not_json)  # NaN and Infinity are not JSON (RFC 8259)
        except (ValueError, RecursionError):
            return False  # not JSON: the policy's output is wrong, the reward is not failing
        return validator.is_valid(value)

    return conforms


def main():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        match = schema_matcher(request) if "schema" in request else regex_matcher(request)
        out.write("+\n")
        out.flush()
        for text in request["texts"]:
            try:
                answer = "1" if match(text) else "0"
            except Exception as e:  # e.g. a $ref that does not resolve: this sample fails, the child goes on
                answer = "!" + f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
            out.write(answer + "\n")
            out.flush()  # the parent times each text: it must see this answer before the next one starts


if __name__ == "__main__":
    main()
