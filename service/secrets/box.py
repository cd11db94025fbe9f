"""Encryption of project secrets at rest (Fernet: AES-128-CBC + HMAC-SHA256, from `cryptography`).

The key comes from the settings (CISPO_SECRET_KEY; several comma-separated
keys rotate: the first encrypts, any decrypts). Without one, the embedded
default creates HOME/secret.key with mode 0600 on first use, so a copied
database alone does not reveal the secrets. A production deployment sets
the key explicitly, the same in the API and the workers.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from service.settings import Settings

KEY_FILE = "secret.key"


class SecretKeyError(RuntimeError):
    """The configured key is unusable, or a stored value was sealed with a key we do not have."""


class SecretBox:
    def __init__(self, keys: str):
        try:
            self._fernet = MultiFernet([Fernet(k.strip().encode()) for k in keys.split(",") if k.strip()])
        except (ValueError, TypeError):
            raise SecretKeyError("CISPO_SECRET_KEY: each key must be 32 url-safe base64 bytes (make one with "
                                 "`python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key()"
                                 ".decode())'`)") from None

    def seal(self, value: str) -> str:
        return self._fernet.encrypt(value.encode()).decode()

    def open(self, token: str) -> str:
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken:
            raise SecretKeyError("a stored secret cannot be decrypted with the configured key(s); was "
                                 "CISPO_SECRET_KEY changed without keeping the old key?") from None


def _key_file(path: Path) -> str:
    """The key in `path`, created (mode 0600) when absent. Written aside and linked into place, so a
    concurrent starter sees either no file or the whole key, and both end up with the same one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(Fernet.generate_key().decode())
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # another process won; use its key
        finally:
            aside.unlink()
    return path.read_text().strip()


@lru_cache
def _box(keys: str) -> SecretBox:
    return SecretBox(keys)


def secret_box(settings: Settings) -> SecretBox:
    return _box(settings.secret_key or _key_file(settings.home.resolve() / KEY_FILE))
