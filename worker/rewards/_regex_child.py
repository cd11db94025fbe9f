"""The regex child: matches one user pattern against a batch of texts, answering text by text.

Started by worker/rewards/regex.py as ``python -I -S -B -c <this source>``.
Standard library only. A pattern is data, not code: it cannot open files or
sockets, so this child needs no sandbox, only to be killable (its parent does
that at a deadline) and bounded in memory (the rlimit below).

Protocol, JSON lines on stdin/stdout:

  parent: {"pattern": str, "full_match": bool, "texts": [str...]}
  child:  one line per text, in order, flushed at once: "1" (matched) or "0"
"""

import json
import re
import resource
import sys

MEMORY_BYTES = 1 << 30  # a backtracking stack or a huge repetition fails with MemoryError, not the host


def main():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pattern = re.compile(request["pattern"])  # validated by the API: a failure here is a crash, reported
        match = pattern.fullmatch if request["full_match"] else pattern.search
        for text in request["texts"]:
            out.write("1\n" if match(text) else "0\n")
            out.flush()  # the parent times each text: it must see this answer before the next one starts


if __name__ == "__main__":
    main()
