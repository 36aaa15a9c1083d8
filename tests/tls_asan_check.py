"""Run under AddressSanitizer and UBSan by tests/test_tls_fuzz.py: ``python -m tests.tls_asan_check BUILD_DIR``.

BUILD_DIR holds ``_tlsseal`` (migratory/server/transport/_tlsseal.c) built with ``-fsanitize=address,undefined``;
this process has libasan preloaded. The sanitized sealer is bound to the same libcrypto as the
installed one (the EVP addresses ``tlstransport`` resolves through ``_ssl``), then:

* records of every size from 1 to 300 bytes and many up to 2^14 + 1, under both key lengths, at
  sequence numbers from 0 to 2^64 - 1, with headers of 1 to 5 bytes, are compared with
  ``cryptography``'s AESGCM;
* ``send`` writes records of all those sizes to a socket whose reader keeps up (its stack buffer
  of the largest record), then to one that fills (the rest comes back), and fails on a dead one;
* every refused argument is refused with an exception;
* many sealers are made and freed;
* the transport's start-up self-tests (:func:`tls_selftest.run_selftests`: its write paths at the
  top of the sequence space, key updates, ``send``, a loopback with an OpenSSL client) run on it.

Prints ``ok <records checked>``; a sanitizer finding aborts the process with its report on stderr.
What libcrypto itself writes into the sealer's buffers is not instrumented (only this module and
the intercepted libc calls are): the byte-for-byte comparisons are what check those bytes.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import socket
import sys


def main(build_dir: str) -> int:
    sys.path.insert(0, build_dir)
    import _tlsseal  # the sanitized build, by its own name (PyInit__tlsseal)
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from migratory.server.transport.tls import libssl as tls_libssl
    from migratory.server.transport.tls import sealer as tls_sealer
    from migratory.server.transport.tls import selftest as tls_selftest

    assert os.path.dirname(os.path.abspath(_tlsseal.__file__)) == os.path.abspath(build_dir), _tlsseal.__file__
    try:
        _tlsseal.Sealer(bytes(16), bytes(12))
    except RuntimeError:
        pass  # "configure() was not called": as it must be
    else:
        raise AssertionError("a Sealer before configure()")
    lib = tls_libssl._libssl()
    assert lib is not None
    addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in tls_sealer._EVP_FUNCTIONS]
    assert all(addresses)
    _tlsseal.configure(*(int(address or 0) for address in addresses))
    Sealer = _tlsseal.Sealer
    rng = random.Random(31)
    checked = 0

    def reference(key: bytes, iv: bytes, seq: int, inner: bytes, header: bytes) -> bytes:
        nonce = (int.from_bytes(iv, "big") ^ seq).to_bytes(12, "big")
        return header + AESGCM(key).encrypt(nonce, inner, header)

    sizes = [*range(1, 301), 1023, 1024, 1025, 4096, 16383, 16384, 16385]
    sizes += [rng.randrange(1, (1 << 14) + 2) for _ in range(200)]
    seqs = [0, 1, 255, 256, (1 << 32) - 1, 1 << 32, (1 << 64) - 2, (1 << 64) - 1]
    for key_len in (16, 32):
        key, iv = rng.randbytes(key_len), rng.randbytes(12)
        sealer = Sealer(key, iv)
        for size in sizes:
            inner = rng.randbytes(size)
            header_len = rng.randrange(1, 6)
            header = rng.randbytes(header_len)
            seq = rng.choice(seqs) if rng.random() < 0.3 else rng.randrange(1 << 64)
            assert sealer.seal(seq, inner, header) == reference(key, iv, seq, inner, header), (key_len, size, seq)
            checked += 1
        # one sealer, many records in a row (the nonce is set again each time)
        for seq in range(500):
            inner = rng.randbytes(rng.randrange(1, 200)) + b"\x17"
            header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
            assert sealer.seal(seq, inner, header) == reference(key, iv, seq, inner, header)
            checked += 1

    # send(): every size through a socket read as it goes, then one that fills up, then a dead one
    key, iv = rng.randbytes(16), rng.randbytes(12)
    sealer = Sealer(key, iv)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    for seq, size in enumerate(sizes):
        inner = rng.randbytes(size)
        header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
        assert sealer.send(ours.fileno(), seq, inner, header) is None  # the reader keeps up
        record = reference(key, iv, seq, inner, header)
        got = bytearray()
        while len(got) < len(record):
            got += theirs.recv(len(record) - len(got))
        assert got == record, size
        checked += 1
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sent = bytearray()
    rest = None
    seq = 0
    while rest is None:
        inner = rng.randbytes(rng.choice((1, 100, 5000, 16385)))
        header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
        record = reference(key, iv, seq, inner, header)
        rest = sealer.send(ours.fileno(), seq, inner, header)
        if rest is not None:
            assert len(rest) > 0 and record.endswith(rest)
            sent += record[: len(record) - len(rest)]
        else:
            sent += record
        seq += 1
        checked += 1
    received = bytearray()
    theirs.setblocking(False)
    while len(received) < len(sent):
        received += theirs.recv(1 << 20)
    assert received == sent
    theirs.close()
    try:
        for n in range(10):
            sealer.send(ours.fileno(), seq + n, b"x\x17", b"\x17\x03\x03\x00\x12")
    except OSError:
        pass
    else:
        raise AssertionError("send() to a dead socket did not fail")
    ours.close()

    # refused arguments
    refused = [
        lambda: Sealer(bytes(24), bytes(12)),
        lambda: Sealer(bytes(16), bytes(11)),
        lambda: Sealer(bytes(16)),
        lambda: Sealer("key", bytes(12)),
        lambda: sealer.seal(0, b"", b"\x17"),
        lambda: sealer.seal(0, bytes((1 << 14) + 2), b"\x17"),
        lambda: sealer.seal(0, b"x", b""),
        lambda: sealer.seal(0, b"x", b"123456"),
        lambda: sealer.seal(-1, b"x", b"\x17"),
        lambda: sealer.seal(1 << 64, b"x", b"\x17"),
        lambda: sealer.seal(0, bytearray(b"x"), b"\x17"),
        lambda: sealer.seal(0, b"x"),
        lambda: sealer.send(-1, 0, b"x", b"\x17"),
        lambda: sealer.send(1 << 40, 0, b"x", b"\x17"),
        lambda: sealer.send(0, 0, b"x"),
        lambda: sealer.send("0", 0, b"x", b"\x17"),
    ]
    for call in refused:
        try:
            call()
        except (ValueError, TypeError, OverflowError):
            pass
        else:
            raise AssertionError("an argument was not refused")

    # made and freed, many times
    for _ in range(5000):
        Sealer(rng.randbytes(rng.choice((16, 32))), rng.randbytes(12)).seal(1, b"y\x17", b"\x17\x03\x03\x00\x12")
    gc.collect()

    # the transport's own paths on it
    tls_sealer._sealer[:] = [Sealer]
    assert tls_sealer.c_sealer() is Sealer
    failed = tls_selftest.run_selftests()
    assert failed is None, failed
    print(f"ok {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
