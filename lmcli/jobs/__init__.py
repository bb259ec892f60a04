"""Batch jobs and what `lmcli generate` runs once its flags are checked: JSONL and OpenAI batch files read
as a stream (input), written row by row, durably (output), resumed by id, input hash and model
(runner); OpenAI batch requests and responses; one prompt or a job (runs); a job shared by torchrun's
ranks (distributed).
"""
