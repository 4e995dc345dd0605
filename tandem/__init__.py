"""The `tandem` command's front door (`tandem.cli`), above the server and the benches."""
