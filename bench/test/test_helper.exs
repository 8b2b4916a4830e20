# Against DATABASE_URL, which needs psql and pgbench on the PATH. The tests
# tagged :peer run when Postgrex is in the build (LOCKS_BENCH_PEERS, README.md).
ExUnit.start(exclude: if(LocksBench.Peer.loaded?(), do: [], else: [:peer]))
