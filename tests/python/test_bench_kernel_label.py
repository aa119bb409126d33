"""difuse.bench.kernel_label: the profiler's kernel names as bench records keep them (pure Python)."""
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from difuse.bench import kernel_label  # noqa: E402


class KernelLabelTest(unittest.TestCase):
    def test_drops_return_type_namespaces_and_parameters(self):
        self.assertEqual(
            kernel_label("void difuse::norm::(anonymous namespace)::grln_streamed_rows<true, true, 64, 4, 96>("
                         "difuse::norm::(anonymous namespace)::Params, int, difuse::norm::(anonymous "
                         "namespace)::StreamTree)"),
            "grln_streamed_rows<true, true, 64, 4, 96>")
        self.assertEqual(kernel_label("void difuse::rope::qk_norm_rope_kernel<16, 1, 8, true, false, true>("
                                      "difuse::rope::(anonymous namespace)::Params)"),
                         "qk_norm_rope_kernel<16, 1, 8, true, false, true>")

    def test_keeps_template_arguments_whole(self):
        # '::' and parentheses inside the template arguments are not namespaces nor the parameter list
        self.assertEqual(
            kernel_label("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
                         "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
                         "std::array<char*, 3ul>)"),
            "vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul> >")
        self.assertEqual(kernel_label("void (anonymous namespace)::copy_rows<(int)2>(float*)"), "copy_rows<(int)2>")

    def test_plain_names_unchanged(self):
        self.assertEqual(kernel_label("sm90_xmma_gemm_bf16bf16_bf16f32"), "sm90_xmma_gemm_bf16bf16_bf16f32")
        self.assertEqual(kernel_label("Memcpy DtoD (Device -> Device)"), "Memcpy DtoD (Device -> Device)")


if __name__ == "__main__":
    unittest.main()
