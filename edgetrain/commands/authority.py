"""`edgetrain init`, `token`, `boards` and `operator`: the fleet authority's records on the
gateway (no torch, no network)."""

from __future__ import annotations

import argparse


def records(args: argparse.Namespace) -> int:
    """init, token, boards, operator: the fleet authority's records (no torch, no network)."""
    import datetime as dt
    import time

    from edgetrain import trust

    directory = args.authority or trust.default_authority_dir()
    if args.command == "init":
        authority = trust.Authority.create(directory, fleet=args.fleet)
        token = authority.new_token(note="made by edgetrain init")
        print(f"fleet authority made in {authority.directory}\nCA fingerprint (sha256): {authority.fingerprint}\n"
              f"on each board:  edgetrain client --join {token}\n"
              f"(that token pairs one board within 24 h; `edgetrain token new` makes more)")
        return 0
    authority = trust.Authority(directory)
    if args.command == "token":
        if args.token_command == "new":
            print(authority.new_token(ttl_s=args.ttl, uses=args.uses, note=args.note))
        elif args.token_command == "revoke":
            authority.revoke_token(args.id)
            print(f"token {args.id} revoked")
        else:
            now = time.time()
            for token_id, record in sorted(authority.tokens().items(), key=lambda kv: kv[1]["created"]):
                state = "expired" if record["expires"] < now else (
                    "used up" if record["uses_left"] < 1 else f"{(record['expires'] - now) / 3600:.1f} h left")
                print(f"{token_id}  {state:>12}  uses left {record['uses_left']}  "
                      f"paired {', '.join(record['used_by']) or '-'}  {record['note']}")
        return 0
    if args.command == "boards":
        if args.boards_command == "revoke":
            serials = authority.revoke(args.name)
            print(f"{args.name}: {len(serials)} certificate(s) revoked; it is refused from its next call on "
                  "(a new join token lets it pair again)")
            return 0
        revoked = authority.revoked_names()
        for serial, record in sorted(authority.certificates().items(), key=lambda kv: kv[1]["issued"]):
            until = dt.datetime.fromtimestamp(record["not_after"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
            state = "revoked" if authority.is_revoked(serial) or record["name"] in revoked else (
                "expired" if record["not_after"] < time.time() else "valid")
            print(f"{record['name']:<24} {record['role']:<9} until {until} UTC  {state}")
        return 0
    path = authority.issue_identity(args.name, trust.OPERATOR).save(args.out)
    print(f"operator credential for {args.name} written to {path}; on that machine save it as "
          f"~/.edgetrain/operator.pem (or pass --identity {path.name})")
    return 0
