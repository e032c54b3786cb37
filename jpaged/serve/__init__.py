"""Serving past one process: engine replicas behind a router that knows their KV caches.

`routing` picks a replica per request (prefix | least_loaded | round_robin); `asgi_call` runs one
HTTP request through a replica's OpenAI app in-process; `gateway` is the front app that reads the
request, routes it, relays the answer and survives a replica's death; `ray` deploys all of it on
Ray Serve (`build_app`, ``jpaged-serve --distributed_executor ray``).

An engine spanning hosts: `mirrored_engine` (the leader's engine calls, run by every host) over
`call_channel` (their messages); `multihost_replica` (a host's process, leader or follower;
``jpaged-serve --distributed_executor jax``); `ray_multihost` and `placement` (its hosts under Ray).
"""
