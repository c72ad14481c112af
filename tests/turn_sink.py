"""A scheduler turn's sink for the tests of every folder (the TurnSink python_backend/core/scheduler.py calls): the
turn's tokens in a list, whether it finished, its error; with `cancel_after`, the client leaves after that many
tokens."""

from __future__ import annotations


class ListSink:
    def __init__(self, cancel_after: int | None = None):
        self.tokens, self.done, self.error, self.cancel_after = [], False, None, cancel_after

    def token(self, token, turn):
        self.tokens.append(token)

    def finished(self, turn):
        self.done = True

    def failed(self, error, turn):
        self.error = error

    def cancelled(self):
        return self.cancel_after is not None and len(self.tokens) >= self.cancel_after
