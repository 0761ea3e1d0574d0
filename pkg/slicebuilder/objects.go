package slicebuilder

import (
	"fmt"
	"sort"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// ResourceSlices turns DriverResources into the ResourceSlice objects the
// kubelet plugin's publisher would create for nodeName, with fixed names so
// that they can be applied as they are (the publisher itself uses
// generated names with the same index prefix).
func ResourceSlices(res resourceslice.DriverResources, nodeName string) []resourceapi.ResourceSlice {
	pools := make([]string, 0, len(res.Pools))
	for name := range res.Pools {
		pools = append(pools, name)
	}
	sort.Strings(pools)
	var out []resourceapi.ResourceSlice
	for _, poolName := range pools {
		pool := res.Pools[poolName]
		generation := max(pool.Generation, 1)
		for i, s := range pool.Slices {
			out = append(out, resourceapi.ResourceSlice{
				TypeMeta: metav1.TypeMeta{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceSlice"},
				ObjectMeta: metav1.ObjectMeta{
					Name: fmt.Sprintf("%s-%s-%02d", nodeName, DriverName, i),
				},
				Spec: resourceapi.ResourceSliceSpec{
					Driver:   DriverName,
					NodeName: &nodeName,
					Pool: resourceapi.ResourcePool{
						Name:               poolName,
						Generation:         generation,
						ResourceSliceCount: int64(len(pool.Slices)),
					},
					Devices:        s.Devices,
					SharedCounters: s.SharedCounters,
				},
			})
		}
	}
	return out
}
