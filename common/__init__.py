"""Shared by every actorlearners script: environments (`common.atari`) and networks (`common.models`)."""
