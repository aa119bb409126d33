"""scripts/sass_kernels.py: the cuobjdump -sass reader behind sass-loops.sh, sass-ops-diff.sh and sass-same.sh, on a
hand-written sample of cuobjdump's format (no CUDA tools needed)."""
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from sass_kernels import sass_kernels  # noqa: E402

SAMPLE = """
Fatbin elf code:
================
arch = sm_90
code version = [1,8]
host = linux
compile_size = 64bit

	code for sm_90
		Function : _Z3fooPf
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe40000000800 */
        /*0010*/              @!P0 BRA 0x0 ;                               /* 0x000000000000894c */
                                                                           /* 0x000fea000383ffff */
		..........


		Function : _Z3barv
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   EXIT ;                                  /* 0x000000000000794d */
                                                                           /* 0x000fea0003800000 */
"""


class SassKernelsTest(unittest.TestCase):
    def test_kernels_their_instructions_and_encodings(self):
        with tempfile.NamedTemporaryFile("w", suffix=".sass", delete=False) as f:
            f.write(SAMPLE)
        self.addCleanup(Path(f.name).unlink)
        k = sass_kernels(f.name)
        self.assertEqual(list(k), ["_Z3fooPf", "_Z3barv"])
        self.assertEqual(k["_Z3fooPf"], [
            (0x0, "LDC R1, c[0x0][0x28]", ("0x00000a00ff017b82", "0x000fe40000000800")),
            (0x10, "@!P0 BRA 0x0", ("0x000000000000894c", "0x000fea000383ffff")),
        ])
        self.assertEqual(k["_Z3barv"], [(0x0, "EXIT", ("0x000000000000794d", "0x000fea0003800000"))])


if __name__ == "__main__":
    unittest.main()
