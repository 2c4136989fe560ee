"""The conversation engine: every channel (WebSocket, REST, terminal) calls it the same way.

Data flows one way: ingress -> queue -> turns (builder, runner, committer) -> publish.
"""
