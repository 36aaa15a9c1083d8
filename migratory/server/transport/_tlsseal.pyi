"""Types of the C extension ``migratory/server/transport/_tlsseal.c`` (TLS 1.3 AES-GCM records in one call)."""

def configure(
    ctx_new: int,
    ctx_free: int,
    encrypt_init: int,
    encrypt_update: int,
    encrypt_final: int,
    ctx_ctrl: int,
    aes_128_gcm: int,
    aes_256_gcm: int,
) -> None: ...

class Sealer:
    def __init__(self, key: bytes, iv: bytes) -> None: ...
    def seal(self, seq: int, inner: bytes, header: bytes) -> bytes: ...
    def send(self, fd: int, seq: int, inner: bytes, header: bytes) -> bytes | None: ...
