"""`lmcli chat`: the REPL (commands, reading messages, showing replies) and the session under it, which
keeps the conversation in the KV cache, writes and resumes transcripts and applies `/set`.
"""
