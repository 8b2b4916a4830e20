import Config

# The library's NIF is built from this checkout's source with cargo, as in
# the library's own :dev and :test builds, not downloaded from a release
# (the library is compiled as a dependency, in :prod).
config :phoenix_kit_agent_locks, build_from_source: true
