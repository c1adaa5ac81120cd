"""Helpers that are public by path: ``litegen.utils.config`` and ``litegen.utils.encode`` (served
by ``litegen.data.vae_encode``, see :data:`litegen.utils.moved_modules.PUBLIC_PATHS`)."""
