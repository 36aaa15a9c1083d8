"""Bytes in and out of client sockets: the worker's own epoll transport (:mod:`.raw`), the lean
TLS 1.3 record layer over OpenSSL's handshake (:mod:`.tls`, sealing in C with :mod:`._tlsseal`),
the TLS context (:mod:`.context`) and the C heap trim the TLS sweep uses (:mod:`.heap`).

May import the core (``migratory.*``) and the standard library; nothing of the engine, the
sessions, the node or the cluster: a transport hands bytes to an ``asyncio.Protocol`` and
does not know what they mean.
"""
