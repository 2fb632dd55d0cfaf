// A shared library the start-method tests are linked with at build time: its functions sit at
// another address in every spawned worker (another run, ASLR), and are found by name there.

extern "C" int linked_quadruple(int x) { return 4 * x; }
