"""The conversation engine: every channel (WebSocket, REST, terminal, chat apps) calls it the
same way, through `engine.Engine`.

Data flows one way: ingress -> queue -> worker (turns: builder -> runner -> committer) ->
publish (`chatcore.common`); background jobs through `scheduler`, external sinks through
`delivery`.
"""
