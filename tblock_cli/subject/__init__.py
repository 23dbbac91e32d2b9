"""The block under test: the built-in block (`builtin`), a user's block from a SPEC (`loading`), the reference it is
held against (`reference`), the decode protocol (`kvcache`), Hugging Face layers (`hf/`), and the setup that builds
any of them through one pipeline (`setup`)."""
