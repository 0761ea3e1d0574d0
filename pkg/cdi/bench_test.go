package cdi

import (
	"testing"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
)

// BenchmarkWriteClaimSpec is one claim's spec written as a prepare writes
// it: JSON, and YAML as it was written before (issue 50), side by side.
func BenchmarkWriteClaimSpec(b *testing.B) {
	spec, err := BuildSpec(claimA(), majors)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("json", func(b *testing.B) {
		w, err := NewWriter(b.TempDir())
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if err := w.Write("uid-a", spec); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("yaml-before", func(b *testing.B) {
		cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(b.TempDir()), cdiapi.WithAutoRefresh(false))
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if err := cache.WriteSpec(spec, SpecName("uid-a")); err != nil {
				b.Fatal(err)
			}
		}
	})
}
