"""The production gateway: fixed actions sent over SSH to a forced command on a target host.

    dispatch.py   SECURITY BOUNDARY, runs ON the target (stdlib only, no bastion import)
    actions.py    the literal action string, checked before anything is sent (GatewayCommand)
    client.py     asyncssh, host key pinned from config, one warm connection per gateway
    keys.py       keygen, the authorized_keys line, the dispatch script's text
    cli.py        `bastion gateway ...` and `bastion approvals ...`

Nothing is imported here, so `bastion gateway dispatch-script` does not load asyncssh.
"""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
