"""TLS 1.3 session resumption on the lean record layer, across workers (migratory/bench/tlsstorm.py).

A storm of clients with full handshakes, then the same clients reconnecting with the tickets the
server gave them: every reconnection must be resumed, whichever of the two workers it lands on
(the workers share the supervisor's ticket keys), and every one must get its WebSocket upgrade
over the resumed session. A correctness check: the CPU saved is the benchmark's to report.
"""

from __future__ import annotations

from migratory.bench.tlsstorm import storm


def test_every_reconnection_resumes_with_its_ticket_on_any_worker() -> None:
    report = storm(clients=400, workers=2, processes=2, concurrency=50)
    assert report.errors == [], report.errors
    assert report.full_connected == report.resumed_connected == 400
    assert report.resumed_reused == 400
    assert report.cipher.startswith("TLS_AES_"), report.cipher
    assert report.full_server_cpu_seconds > 0 and report.resumed_server_cpu_seconds > 0
