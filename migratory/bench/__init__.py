"""The benchmark kit: many clients, many subjects, messages of a given size at a given rate.

Usable as a library (:func:`migratory.bench.runner.run`) and as ``migratory bench``.
Load generators are separate processes of asyncio clients (several source
addresses, so 100,000 connections fit under the per-process open-files limit and
the ephemeral-port range); the publisher stamps each message with its send time so
receivers measure latency; the server's CPU and memory are read from /proc.
"""
