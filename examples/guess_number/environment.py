"""A multi-turn environment: guess a secret whole number; after each wrong guess the environment says which way.

The row gives the range and the secret ({"low", "high", "secret"}); the row's prompt (the rules) is the first
user turn. A guess is the last whole number in the assistant's answer. The episode ends with reward
1 - 0.1 * (wrong guesses) when the guess is right (so fewer guesses score more), or 0 when max_turns runs out.
Standard library only: it runs in the job's sandbox, and the job spec (job.yaml) carries this source inline.
"""

import re


class GuessNumber:
    def reset(self, seed, row):
        self.low, self.high, self.secret = int(row["low"]), int(row["high"]), int(row["secret"])
        self.wrong = 0
        return None  # the row's prompt opens the conversation

    def step(self, action):
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            self.wrong += 1
            return "Answer with a single whole number.", 0.0, False, False, {}
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, max(1.0 - 0.1 * self.wrong, 0.1), True, False, {}
        self.wrong += 1
        hint = "higher" if guess < self.secret else "lower"
        return f"{guess} is wrong: my number is {hint}. Your next guess?", 0.0, False, False, {}
